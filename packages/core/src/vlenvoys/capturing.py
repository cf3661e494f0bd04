"""`vlenvoys.capturing`, as the README and docs name it: a served capture's values in the HTTP client.

`fetch` (`fetch_async`) and `decode` are `vlenvoys.serve.client`'s; `CaptureGone` is the server's 404; `NotLocal` a file fetch this client cannot make; `FETCH_TOGETHER` the most ids one fetch names.
"""

from .serve.capture import CaptureGone
from .serve.client import NotLocal, decode, fetch, fetch_async
from .serve.fields import FETCH_TOGETHER

__all__ = ["FETCH_TOGETHER", "CaptureGone", "NotLocal", "decode", "fetch", "fetch_async"]
