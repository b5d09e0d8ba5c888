from evotrainer.cli import main

main()
