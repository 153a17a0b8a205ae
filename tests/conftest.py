"""Every test starts with the compile cache on disk off (`HEXIR_CACHE_DIR=`), so a test that
changes the compiler's behaviour (a fake toolchain, a monkeypatched pass) never gets a module
another test compiled, and a developer's own cache is left alone. The cache's own tests
(tests/compiler/test_cache.py) point it at a fresh folder."""

import os

os.environ["HEXIR_CACHE_DIR"] = ""
