"""SQLAlchemy storage for samples, requests, runs and plans (no Qt)."""
