"""Training (CORE and its baselines) and evaluation of coreply's retriever and reranker."""
