"""`python -m hexir_runtime` is `hexir-run`."""

import sys

from .cli import main

sys.exit(main())
