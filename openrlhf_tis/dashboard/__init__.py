"""The live dashboard: a command (cli.py) serving the dashboard notebook through Voilà on loopback only
(voila_server.py: local Host headers only, and a template under jupyter/ that loads nothing from a CDN;
voila_app.py: each page frees its kernel as it goes)."""
