import sys

from .converter import main

sys.exit(main())
