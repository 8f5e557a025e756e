from tandem.entrypoints.cli import main

raise SystemExit(main())
