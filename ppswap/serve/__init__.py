"""``ppswap serve``: a training service on Starlette and uvicorn (the ``serve`` extra).

``ppswap.serve.app.create_app(db_path)`` is the ASGI app; ``ppswap.serve.main.serve``
runs it under uvicorn with JSON logs. Jobs train the demo LM
(``ppswap.serve.training``), one at a time (``ppswap.serve.jobs``), their records kept
in SQLite (``ppswap.serve.store``) and their last step checkpointed
(``ppswap.serve.checkpoint``); ``static/`` holds the live page. This package's
``__init__`` imports nothing, so the CLI can tell a missing extra apart.
"""
