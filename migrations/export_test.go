package migrations

import "sync"

// SetAfterLock makes Up and DownTo on database's schema call f once they
// hold their locks, until restore is called.
func SetAfterLock(database, schema string, f func()) (restore func()) {
	return setHook(&afterLock, database, schema, f)
}

// SetOnYield makes Up and DownTo on database's schema call f each time they
// yield to another migrator, until restore is called.
func SetOnYield(database, schema string, f func()) (restore func()) {
	return setHook(&onYield, database, schema, f)
}

func setHook(hooks *sync.Map, database, schema string, f func()) func() {
	key := database + "." + schema
	hooks.Store(key, f)
	hooksSet.Add(1)
	return func() {
		hooks.Delete(key)
		hooksSet.Add(-1)
	}
}
