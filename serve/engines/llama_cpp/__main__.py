"""`python -m serve.engines.llama_cpp ... -- LLAMA-SERVER-ARGV`: the shim (serve/engines/llama_cpp/server.py)."""

import sys

from serve.engines.llama_cpp.server import main

sys.exit(main())
