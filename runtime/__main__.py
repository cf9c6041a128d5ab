import sys

from runtime.serve.cli import main

sys.exit(main())
