"""`python -m radiance ...`: the `radiance` command, for an environment whose scripts are not on PATH."""

from radiance.cli import main

raise SystemExit(main())
