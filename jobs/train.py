"""The ``ray job submit`` entrypoint: ``python jobs/train.py SPEC [a.b=value ...] [--fresh]``.

    ray job submit --working-dir . -- python jobs/train.py jobs/digits.yaml

Ray runs it in the uploaded working dir, with that dir on ``PYTHONPATH`` (so a raytrain
checkout's own code is used) and ``RAY_ADDRESS`` set, so the run joins the cluster.
"""

import sys

from raytrain.cli.app import run

if __name__ == "__main__":
    run(["run", *sys.argv[1:]])
