"""``python -m grpo_plugins.cli``: the ``grpo-plugins`` command."""

import sys

from grpo_plugins.cli import main

sys.exit(main())
