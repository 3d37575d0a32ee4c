from jzero._cli import main

raise SystemExit(main())
