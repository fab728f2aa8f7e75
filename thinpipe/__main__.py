import sys

from thinpipe.cli import main

sys.exit(main())
