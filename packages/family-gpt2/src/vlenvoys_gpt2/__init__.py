"""vlenvoys-gpt2: the GPT-2 family (declarations come in their own issue).

Registered already, so that the entry point and packaging are exercised; it
declares no architecture yet, and a GPT-2 model loads with an error naming
this package.
"""

from vlenvoys import Family

from .version import __version__

__all__ = ["FAMILY", "__version__"]

FAMILY = Family(name="gpt2", vllm=">=0.32,<0.33", architectures={})
