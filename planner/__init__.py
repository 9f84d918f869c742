"""Deployment planner: catalogs, performance model, simulation and search (no torch, no Qt)."""
