"""Train a relay config on the Ray cluster this job runs on.

    ray get-auth-token --generate >/dev/null && chmod 600 ~/.ray/auth_token   # once
    export RAY_AUTH_MODE=token      # token authentication: docs/clusters.md
    ray start --head --disable-usage-stats
    ray job submit --working-dir . -- python jobs/train.py jobs/configs/digits.yaml \
        [--set optim.lr=0.05 ...] [--json]

Same arguments as `relay train`. Runs land under the config's `storage` (default $RELAY_HOME,
else ~/relay on the node running this job, an absolute path, not the job's working dir), so
`relay runs` finds them afterwards.
"""

import sys

from relay.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
