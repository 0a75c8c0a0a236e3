"""``python -m homelab_dp.cli``: the same as the `homelab-dp` console script."""

from homelab_dp.cli.main import main

raise SystemExit(main())
