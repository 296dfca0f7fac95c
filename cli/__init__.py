"""The ``coreply`` command line: the top layer, the only one that imports every wing (training,
evaluation, index builder, service). ``python -m cli`` runs it too."""
