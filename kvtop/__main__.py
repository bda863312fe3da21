from kvtop.cli import main

raise SystemExit(main())
