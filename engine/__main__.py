import sys

from engine.commands.cli import main

sys.exit(main())
