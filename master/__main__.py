import sys

from kvpool.master.main import main

sys.exit(main())
