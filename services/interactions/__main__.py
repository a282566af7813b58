from services.interactions.main import main

main()
