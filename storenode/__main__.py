import sys

from kvpool.storenode.main import main

sys.exit(main())
