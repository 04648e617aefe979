from xpuctl.cli.group import main

main()
