"""Index builder: encodes a response pool into a FAISS index bundle. Not built yet (issue #3)."""
