"""Evaluation of retrievers and rerankers: protocols A and B (through the serving pipeline), metrics
and significance, the restatement judge, reports and plots. Training and the index builder use it."""
