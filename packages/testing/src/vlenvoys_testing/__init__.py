"""vlenvoys-testing: what a family package's tests run vlenvoys against.

- `vlenvoys_testing.tiny_model`: tiny random transformers checkpoints with a tokenizer (`models`);
- `vlenvoys_testing.oracle`: the standard values as transformers computes them;
- `vlenvoys_testing.conformance`: the oracle suite every family imports
  (``from vlenvoys_testing.conformance import *``);
- `vlenvoys_testing.server`: ``vlenvoys serve`` in a process of its own (`servers`);
- `vlenvoys_testing.kept_runner_choice`: a test of the model-runner choice leaves it as it found it (`runners`);
- `vlenvoys_testing.script`: a repository script (``benchmarks/gate.py``) imported by its path, for its tests.

Test support only: the runtime (``vlenvoys-core``) never imports it.
"""

from .models import PROMPTS, architectures, tiny_model
from .runners import kept_runner_choice
from .scripts import script
from .servers import ServerProcess, http_server, server
from .version import __version__

__all__ = ["PROMPTS", "ServerProcess", "__version__", "architectures", "http_server", "kept_runner_choice", "script", "server", "tiny_model"]
