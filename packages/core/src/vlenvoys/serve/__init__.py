"""``vlenvoys serve``: vLLM's OpenAI-compatible server on vlenvoys' worker, in the API server's process.

- `server`: the server started (`main`), its ASGI middleware and the guard on the engine client;
- `fields`, `steering`, `capture`: a request's own fields (``steering``, ``capture``), checked and handed to
  the engine;
- `client`: a capture's values in the HTTP client (`vlenvoys.capturing`).
"""
