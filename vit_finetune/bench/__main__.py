import sys

from vit_finetune.bench.cli import main

sys.exit(main())
