"""Remote code that must never run without model.trust_remote_code = true."""

import os
from pathlib import Path

Path(os.environ.get("HOMELAB_DP_TEST_MARKER", "remote-code-ran")).touch()
