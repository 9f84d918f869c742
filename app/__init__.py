"""Qt desktop application and the command line."""
