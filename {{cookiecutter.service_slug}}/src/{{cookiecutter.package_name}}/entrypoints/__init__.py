"""How the service is started: the HTTP app, the worker, and the command line."""
