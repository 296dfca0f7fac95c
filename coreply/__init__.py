"""coreply's shared package: model definitions, tokenization and truncation, checkpoint I/O,
configuration, text normalisation and corpora. ``training``, ``index_builder`` and ``service``
all import it, so training and serving can never disagree. Importing it loads nothing heavy."""

__version__ = "0.1.0"
