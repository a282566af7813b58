from services.admission.main import main

main()
