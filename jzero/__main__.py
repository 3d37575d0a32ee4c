from jzero.cli import main

raise SystemExit(main())
