from ppoforge.cli import main

raise SystemExit(main())
