"""Panes of the main window; each registers itself in the navigation rail."""
