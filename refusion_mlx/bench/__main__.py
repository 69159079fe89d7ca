import sys

from .compare import main

sys.exit(main())
