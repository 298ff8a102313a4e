"""The console: a page at ``/`` (chat playground, live cache view, what-if) and its routes."""
