"""Index builder: encodes a response pool into a FAISS index bundle (:mod:`index_builder.build`),
appends to one, describes one (:mod:`index_builder.info`), and builds the shipped default
(:mod:`index_builder.default`)."""
