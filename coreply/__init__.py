"""coreply's shared package: model definitions, tokenization and truncation, checkpoint I/O,
configuration, text normalisation and corpora. ``training``, ``index_builder`` and ``service``
all import it, so training and serving can never disagree. Importing it loads nothing heavy; the Python
API (:class:`~coreply.responder.Responder`, :class:`~coreply.responder.Reply`) loads on first use."""

__version__ = "0.1.0"
__all__ = ["Reply", "Responder"]


def __getattr__(name: str):
    if name in __all__:
        from coreply import responder

        return getattr(responder, name)
    raise AttributeError(f"module 'coreply' has no attribute {name!r}")
