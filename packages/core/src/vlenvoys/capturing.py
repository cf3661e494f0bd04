"""`vlenvoys.capturing`, as the README and docs name it: a served capture's values in the HTTP client.

`fetch` (`fetch_async`) and `decode` are `vlenvoys.serve.client`'s; `CaptureGone` is the server's 404.
"""

from .serve.capture import CaptureGone
from .serve.client import decode, fetch, fetch_async

__all__ = ["CaptureGone", "decode", "fetch", "fetch_async"]
