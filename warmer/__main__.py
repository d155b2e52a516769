import sys

from warmer.cli import main

sys.exit(main())
