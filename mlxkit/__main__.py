from mlxkit.cli.main import main

main()
