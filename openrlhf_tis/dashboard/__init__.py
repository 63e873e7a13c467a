"""The live dashboard: a command (cli.py) serving the dashboard notebook through Voilà on loopback only
(voila_server.py, with a template under jupyter/ that loads nothing from a CDN)."""
