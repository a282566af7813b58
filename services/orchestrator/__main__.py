from services.orchestrator.main import main

main()
