"""Attention, norm and rotary ops: torch references behind one dispatch point."""
