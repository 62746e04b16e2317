"""Run a relay sweep (Ray Tune + ASHA, every trial a DDP TorchTrainer) on this job's cluster.

    ray get-auth-token --generate >/dev/null && chmod 600 ~/.ray/auth_token   # once
    export RAY_AUTH_MODE=token      # token authentication: docs/clusters.md
    ray start --head --disable-usage-stats
    ray job submit --working-dir . -- python jobs/tune.py jobs/configs/digits-sweep.yaml \
        [--set num_samples=4 ...] [--json]
    ray job submit --working-dir . -- python jobs/tune.py --resume <sweep id>

Same arguments as `relay tune`. The best trial is registered as a model version
(`relay models`), on the config's absolute storage path.
"""

import sys

from relay.cli import main

if __name__ == "__main__":
    sys.exit(main(["tune", *sys.argv[1:]]))
