"""The /respond service (FastAPI). Not built yet (issue #3)."""
