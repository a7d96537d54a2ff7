import sys

from memfit.cli.main import main

sys.exit(main())
