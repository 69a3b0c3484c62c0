from batchgen.cli.main import main

main()
