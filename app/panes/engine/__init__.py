"""The Engine pane, split into model picker, load panel, chat, live view and benchmark pieces."""
